"""Shared helpers for every lab and chapter script."""
