"""The miner's work, synchronous: load its model, train a round, build the blob it submits.

`miner.model` loads the base model (full or compressed to the group), the genesis state and the
training sequences, and trains one round on the miner's shard; `miner.submission` encodes what was trained into the blob the miner
commits to; `miner.settings` is how this machine trains (no heavy import: the node config's `[miner]`
section extends it). The daemon's duty (node.duties.miner) and the offline `tessera train` both drive these.
This package knows nothing about networking, asyncio, rounds' phases, scoring or merging, and never
imports `node` or `validator`.
"""
