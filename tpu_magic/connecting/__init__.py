"""The logic of %tpu_connect: backend and target, reachability, --check, the doctor."""
