"""A `fit`: planned (`plan`), run (`run`), its bar and timing, its stops, its use of the device."""
