"""The tensor math of speculation, as plain functions of tensors: verification, sampling and the
fork. The runtime calls them eagerly and the epilogue passes splice the very same functions into
the stage graphs, so eager and compiled paths agree exactly. Imports nothing from Saguaro."""
