B
sum_dy_xmuJ*•À+‘£@üÑ0A