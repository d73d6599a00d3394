"""AFD connectors: the transport between attention and FFN ranks, and the messages they carry."""
