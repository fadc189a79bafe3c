"""Quadrature encoder drivers (serial counter board, Phidget22) publishing ``enc/<name>`` messages."""
