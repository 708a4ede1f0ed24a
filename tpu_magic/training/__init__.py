"""The logic of %%tpu_train and %tpu_sync: one cell's calls and a module for each step."""
