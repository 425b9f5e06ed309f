"""What a role does each phase: global-state consensus (both roles), miner duties, validator duties."""
