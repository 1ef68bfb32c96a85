"""CTR example: synthetic Criteo-like data (:mod:`.data`), a wide&deep model with a pluggable
embedding (:mod:`.model`) and the single-process baseline (:mod:`.baseline`) that the
parameter-server version is measured against."""
