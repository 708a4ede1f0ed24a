"""`%tpu_sync`: the CPU copy of a trained model, which model is copied, and LoRA adapters alone."""
