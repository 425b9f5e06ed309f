"""A node's runtime: config, clock, round scheduler, the daemon that wires everything, HTTP API and metrics."""
