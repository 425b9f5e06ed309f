"""Synchronous torch + transformers work: model adapters, expert slicing, local training,
evaluation, the outer optimizer, canonical blobs, data and expert selection.

Nothing here does networking or asyncio; the node package runs it off the event loop.
"""
