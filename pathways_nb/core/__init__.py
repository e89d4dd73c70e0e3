"""Used by both sides: dataflow, events, shared memory, security, session options."""
