"""Simulation: a whole network on one machine (layout, processes, adversary strategies, a control-channel peer)."""
