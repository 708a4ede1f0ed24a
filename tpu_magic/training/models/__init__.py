"""What tpu_magic does to a model before its calls run: settings, dtype policies, rebuilding one made outside the strategy."""
