"""Data tools behind commands: query-document pairs, page rendering, colpali conversion."""
