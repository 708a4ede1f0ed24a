"""The bottom layer: what every layer may use (see ARCHITECTURE.md)."""
