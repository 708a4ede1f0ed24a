"""Keras on JAX: `DataParallel` and `ModelParallel` over the devices, `PyDataset` inputs,
several processes joined into one run, the compilation cache. `backend.py` holds the
`Backend` object; each other module does one of its jobs. Importing this package imports
no framework."""
