"""The tensor math of speculation as plain tensor functions, run eagerly and spliced into the stage graphs
alike, so both paths agree exactly. Imports nothing from Saguaro."""
