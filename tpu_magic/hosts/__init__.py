"""Several hosts: the same `%%tpu_train` cell on every process of a multi-controller JAX run,
through IPython's ipyparallel engines (one a host), rehearsed on one machine as local
engines with CPU devices and gloo collectives (`%tpu_connect --simulate HxD`)."""
