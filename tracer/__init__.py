"""Tracer: the dispatch mode, op tables, signatures and the trace trie."""
