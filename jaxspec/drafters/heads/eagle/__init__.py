"""EAGLE-1/2 and EAGLE-3 heads: modules, their drafter, published-layout loaders."""
