"""Hardware drivers and device emulators publishing sensor messages on the bus."""
