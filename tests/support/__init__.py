"""Test helpers that are not tests: subprocess fixtures, loopback doubles, sample data."""
