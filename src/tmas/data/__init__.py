"""Problem data (``tmas data``): verifiable problem generators, importers of official benchmark files, MATTRL's
medicine and education case formats, and the difficulty filter of the TMAS paper (appendix A.2)."""
