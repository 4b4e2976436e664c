"""Pure domain: models, workflow definitions, transition rules. No I/O, no clock, no SQL."""
