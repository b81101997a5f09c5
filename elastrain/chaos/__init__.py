"""Fault injection: in-worker fault points and the launcher's fault schedule."""
