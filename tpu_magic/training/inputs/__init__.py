"""A call's inputs: its batch, checked (`planning`), built as whole batches (`build`), and padding masked out of losses and metrics (`exactness`)."""
