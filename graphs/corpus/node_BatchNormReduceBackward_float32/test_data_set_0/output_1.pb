B
sum_dy_xmuJŠZx@ßUAP¬e@