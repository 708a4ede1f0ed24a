"""`--checkpoint` and `--resume`: what a checkpoint holds, its forms (one HDF5 file, orbax
shards), the directory, and a cell's use of them."""
