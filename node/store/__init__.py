"""A node's durable state: SQLite for what happened, a content-addressed directory for blobs."""
