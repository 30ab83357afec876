"""The text ``autoshard demo`` trains its byte-level model on: autoshard describing itself."""

TEXT = """\
A model that one device can no longer train fast enough is split across many. Each operator
decides how its inputs and outputs are cut: by rows, by columns, by the batch, or not at all.
When one operator leaves a tensor cut one way and the next wants it cut another way, the
tensor moves between the two layouts, and the move that sends the fewest bytes is chosen.

A layout is a device matrix and a tensor map. The device matrix names the axes of the mesh,
such as data parallel and tensor parallel; the tensor map says which axes cut which dimension
of the tensor. A partial sum is a tensor each device holds a part of, whose true value is the
sum over an axis. A matrix product whose inner dimension is cut leaves its output partial, and
a reduce-scatter or an all-reduce makes it whole again.

Data parallelism copies the model and cuts the batch; the gradients are summed in buckets that
overlap the backward pass. Tensor parallelism cuts the weights of a layer: the first linear
layer of a block by columns and the second by rows, so that the pair needs one sum in forward
and one in backward. The optimizer state, then the gradients, then the parameters themselves
can be sharded over the data-parallel replicas, each rank holding only its rows and gathering
a block's parameters just before the block runs.

A plan is every operator's split, the mesh, and the stage of sharding. The cost model prices a
plan: the time of each operator on its share of the work, the time of each collective on the
links it crosses, the memory each device holds at its peak. The search finds the plan with the
least time that fits in memory, among all splits of every operator, on meshes of every shape.

The equivalence invariant is the test of it all: a parallel run, compared with the run on one
device, gives the same losses and the same parameters, step after step. Dropout draws the same
masks; the data arrives in the same order; a checkpoint written on four ranks loads on two, or
on one, and training goes on as if it had never stopped.
"""
