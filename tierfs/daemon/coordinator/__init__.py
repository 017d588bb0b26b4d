"""The coordinator: the engine that wires the parts, the control file, the status snapshot."""
