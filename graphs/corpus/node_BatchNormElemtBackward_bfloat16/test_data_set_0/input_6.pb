B
sum_dy_xmuJì@Œ?AğÀ