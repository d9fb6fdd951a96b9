"""Data manager: the models, services (writes), selectors (reads) and curation policies."""
