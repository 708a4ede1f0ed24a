"""Where a cell's model lives: the connection and mesh (`place`), the memory plan, and the sharding table."""
