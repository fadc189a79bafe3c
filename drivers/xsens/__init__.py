"""Xsens MTi over Xbus: framing, MTData2 decoding, device driver."""
