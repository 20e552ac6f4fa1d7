"""Drafters: who proposes the draft tree each round."""
