"""Channel adapters: the edges where platform events become ``Inbound`` and replies leave."""
