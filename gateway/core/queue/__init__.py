"""The pipeline's wait for a backend: one turn in a deployment's fair queue (`turn`), what a caller
may ask of the queue per request, a priority and a deadline (`hints`), and large tensor requests
split into row slices that each take their own turn (`row_slices`)."""
