"""Request lifecycle: admission, the engine-core step, output processing. No device code here."""
