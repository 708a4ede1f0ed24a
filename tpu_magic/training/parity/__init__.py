"""The first-step parity check: a cell's first distributed step against the same step on one
device, from the same weights and the same batch.

At a cell's first `fit` (on by default; `--verify off` skips it) the state before the first
step is copied to the host, the step runs as it always does, and the backend runs the same
step on one device with plain Keras's code on the batch's real rows. The logs and the size of
the update are compared (`compare`); a difference over the tolerance is a warning naming
both numbers and the likely cause; nothing is changed. Where the check cannot be exact it is
skipped with a note. `check` decides whether a fit is checked and builds the Keras callback
(`callback.FirstStep`) that does it.
"""
