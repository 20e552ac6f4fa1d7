"""Medusa heads: module, drafter, published-layout loader."""
