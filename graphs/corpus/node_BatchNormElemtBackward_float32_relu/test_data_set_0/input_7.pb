B
sum_dy_xmuJ¸y:¿Ö&NAşÛ@