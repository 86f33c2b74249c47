B
sum_dy_xmuJ?µ®ֱkÜ,Aרסױֱ