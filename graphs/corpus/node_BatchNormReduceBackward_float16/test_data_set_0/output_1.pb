B
sum_dy_xmuJ-8‰ÁƒäyAIÎ]A