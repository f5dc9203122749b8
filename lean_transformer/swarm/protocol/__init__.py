"""What peers of one run say to each other through the DHT: joining it (:mod:`.dht`), signed metrics records
(:mod:`.metrics`), the settings every peer must agree on (:mod:`.settings`, checked by :mod:`.agreement`)."""
