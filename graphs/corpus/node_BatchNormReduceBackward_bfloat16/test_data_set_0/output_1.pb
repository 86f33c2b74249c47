B
sum_dy_xmuJæ¿•?UAd¿