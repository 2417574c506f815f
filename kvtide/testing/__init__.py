"""Test support shipped with the package (fault injection); inert unless its env vars are set."""
