"""Draft heads (Medusa, EAGLE-1, EAGLE-3) loaded from their public checkpoint layouts."""
