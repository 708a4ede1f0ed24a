"""The notebook face: the magics, the panel, the workspace and its guards, the panel's job."""
