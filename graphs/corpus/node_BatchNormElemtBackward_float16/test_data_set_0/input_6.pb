B
sum_dy_xmuJ:À@o∂¿èΩ¡