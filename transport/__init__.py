"""Everything about KV crossing a boundary: the wire format, connector configs, the cost model."""
