"""Device emulators on pseudo-terminals for hardware-free tests."""
