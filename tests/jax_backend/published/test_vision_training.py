"""Published Keras code on JAX, 8 simulated devices beside one: vision training patterns.

How they are written and compared: this folder's conftest.py.
"""

import pytest

from support.cells import CIFAR_SHAPED
from support.same import both, same_history, same_values, same_weights


# examples/vision/knowledge_distillation.py: a teacher CNN trained in an EARLIER cell, then
# a Distiller (keras.Model holding teacher and student) whose compile takes a student loss,
# a KLDivergence distillation loss, alpha and temperature, and whose compute_loss mixes
# them (Keras 3 form of the example's step); fit with the default batch of 32 on 203
# images, then evaluate.
DISTILLER = """
x_train = np.random.random((203, 28, 28, 1)).astype("float32")
y_train = np.random.randint(0, 10, 203)
x_test, y_test = x_train[:61], y_train[:61]
teacher = keras.Sequential([
    keras.Input(shape=(28, 28, 1)),
    keras.layers.Conv2D(32, (3, 3), strides=(2, 2), padding="same"),
    keras.layers.LeakyReLU(negative_slope=0.2),
    keras.layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
    keras.layers.Conv2D(64, (3, 3), strides=(2, 2), padding="same"),
    keras.layers.Flatten(),
    keras.layers.Dense(10),
], name="teacher")
teacher.compile(optimizer=keras.optimizers.Adam(),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=[keras.metrics.SparseCategoricalAccuracy()])
teacher.fit(x_train, y_train, epochs=1, verbose=0)

class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1,
                temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            keras.ops.softmax(teacher_pred / self.temperature, axis=1),
            keras.ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature ** 2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)
"""


def test_knowledge_distillation_from_a_teacher_trained_in_an_earlier_cell(ip):
    plain, ours, _ = both(ip, DISTILLER, """
student = keras.Sequential([
    keras.Input(shape=(28, 28, 1)),
    keras.layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same"),
    keras.layers.LeakyReLU(negative_slope=0.2),
    keras.layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
    keras.layers.Conv2D(32, (3, 3), strides=(2, 2), padding="same"),
    keras.layers.Flatten(),
    keras.layers.Dense(10),
], name="student")
distiller = Distiller(student=student, teacher=teacher)
distiller.compile(optimizer=keras.optimizers.Adam(),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()],
                  student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  distillation_loss_fn=keras.losses.KLDivergence(), alpha=0.1, temperature=10)
history = distiller.fit(x_train, y_train, epochs=2, shuffle=False, verbose=0)
evaluation = distiller.evaluate(x_test, y_test, return_dict=True, verbose=0)
""")
    same_history(plain, ours)
    same_values(plain, ours, "evaluation")
    same_weights(plain, ours, "student")


# examples/vision/siamese_contrastive.py: pairs of images, a shared embedding tower
# (BatchNormalization, tanh convolutions, average pooling), a Lambda Euclidean distance, a
# contrastive loss of its own that ends in `ops.mean`, RMSprop, batch 16, validation data.
def test_siamese_network_with_a_contrastive_loss(ip):
    plain, ours, _ = both(ip, """
rs = np.random.RandomState(7)
x_train_1 = rs.random((203, 28, 28, 1)).astype("float32")
x_train_2 = rs.random((203, 28, 28, 1)).astype("float32")
labels_train = rs.randint(0, 2, 203).astype("float32")
x_val_1 = rs.random((45, 28, 28, 1)).astype("float32")
x_val_2 = rs.random((45, 28, 28, 1)).astype("float32")
labels_val = rs.randint(0, 2, 45).astype("float32")

def euclidean_distance(vects):
    x, y = vects
    sum_square = keras.ops.sum(keras.ops.square(x - y), axis=1, keepdims=True)
    return keras.ops.sqrt(keras.ops.maximum(sum_square, keras.backend.epsilon()))

def loss(margin=1):
    def contrastive_loss(y_true, y_pred):
        square_pred = keras.ops.square(y_pred)
        margin_square = keras.ops.square(keras.ops.maximum(margin - (y_pred), 0))
        return keras.ops.mean((1 - y_true) * square_pred + (y_true) * margin_square)
    return contrastive_loss
""", """
input = keras.layers.Input((28, 28, 1))
x = keras.layers.BatchNormalization()(input)
x = keras.layers.Conv2D(4, (5, 5), activation="tanh")(x)
x = keras.layers.AveragePooling2D(pool_size=(2, 2))(x)
x = keras.layers.Conv2D(16, (5, 5), activation="tanh")(x)
x = keras.layers.AveragePooling2D(pool_size=(2, 2))(x)
x = keras.layers.Flatten()(x)
x = keras.layers.BatchNormalization()(x)
x = keras.layers.Dense(10, activation="tanh")(x)
embedding_network = keras.Model(input, x)
input_1 = keras.layers.Input((28, 28, 1))
input_2 = keras.layers.Input((28, 28, 1))
tower_1 = embedding_network(input_1)
tower_2 = embedding_network(input_2)
merge_layer = keras.layers.Lambda(euclidean_distance, output_shape=(1,))([tower_1, tower_2])
normal_layer = keras.layers.BatchNormalization()(merge_layer)
output_layer = keras.layers.Dense(1, activation="sigmoid")(normal_layer)
siamese = keras.Model(inputs=[input_1, input_2], outputs=output_layer)
siamese.compile(loss=loss(margin=1), optimizer="RMSprop", metrics=["accuracy"])
history = siamese.fit([x_train_1, x_train_2], labels_train,
                      validation_data=([x_val_1, x_val_2], labels_val),
                      batch_size=16, epochs=2, shuffle=False, verbose=0)
results = siamese.evaluate([x_val_1, x_val_2], labels_val, return_dict=True, verbose=0)
distances = siamese.predict([x_val_1[:5], x_val_2[:5]], verbose=0)
""")
    same_history(plain, ours)
    same_values(plain, ours, "results")
    same_values(plain, ours, "distances")


# examples/vision/supervised-contrastive-learning.py: an encoder with a Normalization
# adapted before training, pretrained with a supervised contrastive loss (a Loss subclass
# whose __call__ compares every pair of feature vectors in the batch: the npairs loss, in
# keras.ops), then frozen (`layer.trainable = False` for every encoder layer) under a new
# classifier that is trained and evaluated. (The example's batch is 265; 8 does not divide
# it, so here 64.)
def test_supervised_contrastive_pretraining_then_a_frozen_encoder(ip):
    plain, ours, _ = both(ip, CIFAR_SHAPED + """
data_augmentation = keras.Sequential([keras.layers.Normalization(),
                                      keras.layers.RandomFlip("horizontal"),
                                      keras.layers.RandomRotation(0.02)])
data_augmentation.layers[0].adapt(x_train)

def create_encoder():
    inputs = keras.Input(shape=(32, 32, 3))
    x = data_augmentation(inputs)
    x = keras.layers.Conv2D(16, 3, activation="relu")(x)
    x = keras.layers.Conv2D(32, 3, strides=2, activation="relu")(x)
    outputs = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs=inputs, outputs=outputs, name="cifar10-encoder")

def create_classifier(encoder, trainable=True):
    for layer in encoder.layers:
        layer.trainable = trainable
    inputs = keras.Input(shape=(32, 32, 3))
    features = encoder(inputs)
    features = keras.layers.Dropout(0.5)(features)
    features = keras.layers.Dense(64, activation="relu")(features)
    features = keras.layers.Dropout(0.5)(features)
    outputs = keras.layers.Dense(10, activation="softmax")(features)
    model = keras.Model(inputs=inputs, outputs=outputs, name="cifar10-classifier")
    model.compile(optimizer=keras.optimizers.Adam(0.001),
                  loss=keras.losses.SparseCategoricalCrossentropy(),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    return model

class SupervisedContrastiveLoss(keras.losses.Loss):
    def __init__(self, temperature=1, name=None):
        super().__init__(name=name)
        self.temperature = temperature

    def __call__(self, labels, feature_vectors, sample_weight=None):
        normalized = feature_vectors / keras.ops.norm(feature_vectors, axis=1, keepdims=True)
        logits = keras.ops.divide(keras.ops.matmul(normalized, keras.ops.transpose(normalized)),
                                  self.temperature)
        labels = keras.ops.reshape(labels, (-1, 1))
        same_class = keras.ops.cast(keras.ops.equal(labels, keras.ops.transpose(labels)), "float32")
        same_class = same_class / keras.ops.sum(same_class, axis=1, keepdims=True)
        return keras.ops.mean(keras.ops.categorical_crossentropy(same_class, logits,
                                                                 from_logits=True))

def add_projection_head(encoder):
    inputs = keras.Input(shape=(32, 32, 3))
    outputs = keras.layers.Dense(32, activation="relu")(encoder(inputs))
    return keras.Model(inputs=inputs, outputs=outputs, name="encoder_with_projection-head")
""", """
encoder = create_encoder()
encoder_with_projection_head = add_projection_head(encoder)
encoder_with_projection_head.compile(optimizer=keras.optimizers.Adam(0.001),
                                     loss=SupervisedContrastiveLoss(0.05))
pretraining = encoder_with_projection_head.fit(x=x_train, y=y_train, batch_size=64, epochs=2,
                                               shuffle=False, verbose=0)
classifier = create_classifier(encoder, trainable=False)
history = classifier.fit(x=x_train, y=y_train, batch_size=64, epochs=2, shuffle=False,
                         verbose=0)
accuracy = classifier.evaluate(x_test, y_test, verbose=0)[1]
""")
    same_history(plain, ours, "pretraining")
    same_history(plain, ours)
    assert ours["accuracy"] == pytest.approx(plain["accuracy"])


# examples/vision/mixup.py: every training batch mixed with a second batch of the same size
# by a Beta-distributed weight (images and one-hot labels alike), the mixing done in the
# input pipeline (grain here; the example's is tf.data), a small CNN, validation data.
def test_mixup_in_a_grain_pipeline(ip):
    plain, ours, _ = both(ip, """
import grain
rs = np.random.RandomState(8)
x_train = rs.random((203, 28, 28, 1)).astype("float32")
y_train = keras.utils.to_categorical(rs.randint(0, 10, 203), 10).astype("float32")
x_val, y_val = x_train[:45], y_train[:45]
BATCH_SIZE = 64
partner = np.random.RandomState(9).permutation(203)
mixing = np.random.RandomState(10).beta(0.2, 0.2, 203).astype("float32")

def mix_up(i):
    l = mixing[i]
    j = partner[i]
    return (x_train[i] * l + x_train[j] * (1 - l), y_train[i] * l + y_train[j] * (1 - l))

train_ds_mu = grain.MapDataset.source(np.arange(203)).map(mix_up).batch(BATCH_SIZE)
val_ds = grain.MapDataset.source(np.arange(45)).map(
    lambda i: (x_val[i], y_val[i])).batch(BATCH_SIZE)
""", """
model = keras.Sequential([
    keras.layers.Input(shape=(28, 28, 1)),
    keras.layers.Conv2D(16, (5, 5), activation="relu"),
    keras.layers.MaxPooling2D(pool_size=(2, 2)),
    keras.layers.Conv2D(32, (5, 5), activation="relu"),
    keras.layers.MaxPooling2D(pool_size=(2, 2)),
    keras.layers.Dropout(0.2),
    keras.layers.GlobalAvgPool2D(),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
])
model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
history = model.fit(train_ds_mu, validation_data=val_ds, epochs=2, verbose=0)
_, test_acc = model.evaluate(val_ds, verbose=0)
""")
    same_history(plain, ours)
    assert ours["test_acc"] == pytest.approx(plain["test_acc"])


# examples/vision/3D_image_classification.py: a Conv3D network (BatchNormalization after
# every pooling), Adam on an ExponentialDecay(staircase=True) schedule, binary
# crossentropy, ModelCheckpoint and EarlyStopping(monitor="val_acc"), validation data; then
# predict one volume. (The example's batch of 2 is under the 8 devices: here 16.)
def test_3d_convolutions_with_an_exponential_decay_schedule(ip):
    plain, ours, _ = both(ip, """
import os, tempfile
rs = np.random.RandomState(11)
x_train = rs.random((53, 16, 16, 8, 1)).astype("float32")
y_train = rs.randint(0, 2, 53).astype("float32")
x_val, y_val = x_train[:21], y_train[:21]
checkpoint = os.path.join(tempfile.mkdtemp(), "3d_image_classification.keras")
""", """
inputs = keras.Input((16, 16, 8, 1))
x = keras.layers.Conv3D(filters=8, kernel_size=3, activation="relu")(inputs)
x = keras.layers.MaxPool3D(pool_size=2)(x)
x = keras.layers.BatchNormalization()(x)
x = keras.layers.Conv3D(filters=16, kernel_size=3, activation="relu", padding="same")(x)
x = keras.layers.MaxPool3D(pool_size=2)(x)
x = keras.layers.BatchNormalization()(x)
x = keras.layers.GlobalAveragePooling3D()(x)
x = keras.layers.Dense(units=32, activation="relu")(x)
x = keras.layers.Dropout(0.3)(x)
outputs = keras.layers.Dense(units=1, activation="sigmoid")(x)
model = keras.Model(inputs, outputs, name="3dcnn")
lr_schedule = keras.optimizers.schedules.ExponentialDecay(0.0001, decay_steps=2,
                                                          decay_rate=0.96, staircase=True)
model.compile(loss="binary_crossentropy",
              optimizer=keras.optimizers.Adam(learning_rate=lr_schedule), metrics=["acc"])
checkpoint_cb = keras.callbacks.ModelCheckpoint(checkpoint, save_best_only=True)
early_stopping_cb = keras.callbacks.EarlyStopping(monitor="val_acc", patience=15)
history = model.fit(x_train, y_train, validation_data=(x_val, y_val), epochs=3, batch_size=16,
                    shuffle=False, verbose=0, callbacks=[checkpoint_cb, early_stopping_cb])
prediction = model.predict(np.expand_dims(x_val[0], axis=0), verbose=0)[0]
iterations = int(model.optimizer.iterations)
""")
    same_history(plain, ours)
    assert ours["iterations"] == plain["iterations"] == 12
    same_values(plain, ours, "prediction")


# examples/vision/reptile.py: the meta-learning loop saves the weights, takes a few SGD
# steps on a 5-way 1-shot mini-batch (5 images), moves the saved weights part of the way
# and evaluates on held-out images. The example steps with a GradientTape (TensorFlow);
# written here as a JAX user writes it, with train_on_batch, test_on_batch and
# predict_on_batch on the 5-row batches (8 does not divide 5).
def test_reptile_loop_with_train_on_batch_on_five_rows(ip):
    plain, ours, _ = both(ip, """
rs = np.random.RandomState(12)
images = rs.random((5, 28, 28, 1)).astype("float32")
labels = np.arange(5)
test_images = rs.random((5, 28, 28, 1)).astype("float32")
def conv_bn(x):
    x = keras.layers.Conv2D(filters=16, kernel_size=3, strides=2, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    return keras.layers.ReLU()(x)
""", """
inputs = keras.layers.Input(shape=(28, 28, 1))
x = conv_bn(inputs)
x = conv_bn(x)
x = keras.layers.Flatten()(x)
outputs = keras.layers.Dense(5, activation="softmax")(x)
model = keras.Model(inputs=inputs, outputs=outputs)
model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.003),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"])
losses, tests = [], []
for meta_iter in range(3):
    cur_meta_step_size = (1 - meta_iter / 3) * 0.25
    old_vars = model.get_weights()
    for _ in range(4):
        losses.append(model.train_on_batch(images, labels))
    new_vars = model.get_weights()
    model.set_weights([old + (new - old) * cur_meta_step_size
                       for old, new in zip(old_vars, new_vars)])
    tests.append(model.test_on_batch(images, labels))
test_preds = model.predict_on_batch(test_images)
""")
    same_values(plain, ours, "losses")
    same_values(plain, ours, "tests")
    assert ours["test_preds"].shape == (5, 5)
    same_values(plain, ours, "test_preds")
    same_weights(plain, ours)
