"""K steps a dispatch on JAX: a call's steps run in groups, each group one compiled program,
a `jax.lax.scan` over its K stacked batches of Keras's own step.

Keras 3.15's JAX trainer runs `steps_per_execution` as a host loop of one-step calls, so the
host pays a dispatch, a transfer and Keras's own loop for every step, and a small model's
chip waits for it. While tpu_magic runs a model's call its train, test and predict
functions are the loop's, in parts, one job a module:

- `calls`: Keras's functions swapped for the loop's for the call (`grouped`), and what they
  do an execution: read its batches, run them, time the first steps where K is chosen;
- `pace`: how many steps an execution runs, fixed or chosen from the call's first steps as
  they train (no step run for the choice alone, no copy of the state);
- `reading`: an execution's batches, read from tpu_magic's own pipeline a group at a time
  (the next one staged while the device runs) or taken from Keras's iterator, stacked;
- `programs`: the compiled programs, kept in the model's record, one a kind, group length
  and batch type, each compiled once and shared with the memory plan (`abstract_train`);
- `epoch_reads`: Keras's epoch iterator counting what each execution reads, so every step
  reads the batch one step an execution reads.

K scanned steps compute what K single steps compute: the scan's body is Keras's own
stateless step, its carry the state Keras carries, and the logs are the last step's, as
Keras's own `steps_per_execution` gives them.
"""
